"""The relay tree: owners stream payloads to one root, which forwards them down a tree.

Each payload crosses the cluster boundary once (owner -> root); every further copy
travels over local links inside the rollout cluster (docs/architecture.md). The package
holds, one concern per module: the tree math (:mod:`.tree`), a node's settings
(:mod:`.settings`), what members say to each other (:mod:`.wire`), the bounded staging
area (:mod:`.staging`), the client that owners, receivers and the nodes themselves use
(:mod:`.client`), and the node, an HTTP server, with the process entry point behind
``dcr relay`` (:mod:`.node`). Errors are :class:`dcr.errors.RelayError` and
:class:`dcr.errors.RelayNotFound`.

Choices, and why:

* **Wire protocol: HTTP/1.1 with aiohttp.** A request body is a byte stream, so a node
  can read a payload chunk by chunk while it forwards each chunk onwards; TCP flow
  control is the back-pressure (a node that does not read a body stops its sender);
  ``GET /healthz`` is an ordinary probe for parents and for Kubernetes; aiohttp is
  already a dependency.
* **Tree: members in order, fan-out K.** ``parent(i) = (i-1)//K``,
  ``children(i) = K*i+1 .. K*i+K`` within range; index 0 is the root. Depth is
  ``ceil(log_K(n(K-1)+1)) - 1``; every node derives the same tree from the same list.
* **Cut-through forwarding, not store-and-forward.** A ``PUT`` must carry
  ``Content-Length`` (the budget is reserved from it before one body byte is read). Each
  chunk read from the body is copied once into the staging buffer (or written to the
  spool file) and the same ``bytes`` object is handed to one bounded queue per child;
  a streaming ``PUT`` per child drains its queue. So a payload reaches a leaf while the
  owner is still sending it, and a slow child slows its parent down to the queue depth
  rather than growing memory. A child that takes nothing for ``stall_timeout_s`` loses
  the live copy and gets the staged bytes again later.
* **Verification at every hop.** When the body is complete the node runs
  :func:`dcr.format.payload.read_payload` (framing, digest, header) and checks the
  header's ``(attempt, owner, seq)`` against the URL; manifests are parsed with
  :class:`dcr.format.manifest.Manifest`. A failure answers 400, drops the bytes and
  aborts the forwards still running (children see a short body and drop theirs; they
  would also reject it on their own, since they run the same checks).
* **Two credentials: read and publish.** GETs (listings, bytes, status) take either
  token; everything that changes what a node holds or where it sends it (``PUT`` of a
  payload or manifest, ``DELETE`` of an attempt, ``POST /v1/subscribe``) takes the
  publish token; a wrong or missing token answers 401, the read token on a write 403.
  Owners hold the publish token (``$DCR_RELAY_TOKEN`` of ``dcr encode``), agents only
  the read token (``--relay-token-file``). Members hold both (``dcr relay --token-file
  READ --publish-token-file PUBLISH``): forwarding to a child is a ``PUT`` and
  re-attaching is a subscription, so a member authenticates to the others with the
  publish token. An agent's token, or a read token taken from a rollout pod's agent
  container, therefore cannot push, replace or drop a payload anywhere in the tree. The
  tokens must differ and pass :func:`dcr.http.tokens.check_token`.
* **First upload of an id wins; receivers decide.** Only publishers push, and a
  second ``PUT`` of a held id with other bytes is refused (409) and logged; what a
  relay holds is still only a candidate: a receiver applies a payload only after
  checking its size and digest against the attempt's manifest (:mod:`dcr.transport.receive`),
  so bytes a publisher put under the wrong id fail the attempt instead of changing bits.
* **Hop ack means "queued".** 201 says this node holds verified bytes and has started
  forwarding; it does not wait for children. Completion comes from the receivers' flush.
* **Idempotence by payload id.** A second ``PUT`` of an id with the same BLAKE2b-128
  digest of the whole object answers 200 "duplicate" and is not forwarded again; other
  bytes under a held id answer 409. A ``PUT`` of an id still arriving waits for it.
* **Staging budget.** Uploads reserve their size in memory up to ``budget_bytes``, then
  on disk under ``spool_dir`` up to ``spool_budget_bytes``; when neither fits, the
  upload waits without reading its body and answers 503 after ``admit_timeout_s``. A
  payload that can never fit answers 413. Staged bytes stay until ``DELETE`` of their
  attempt. Beyond the budget a node holds only the per-child queues
  (children x ``queue_chunks`` chunks) and per-connection read buffers (measured: about
  0.6 MiB per waiting upload, whatever its size).
* **Manifests** travel the same endpoints and dedup rules but, being small and the
  attempt's last word, are stored before they are forwarded, and a node forwards a
  manifest to a child only after every payload forward of that attempt to that child
  has ended, so a manifest never overtakes the payloads its sender held before it.
* **Failures.** A non-root node probes its current parent every ``health_interval_s``;
  after ``parent_timeout_s`` without an answer it subscribes to the nearest live
  ancestor (``POST /v1/subscribe`` with its index and the ids it holds). The new parent
  adds it to its forward set and replays every staged payload and manifest it lacks
  (and those still arriving, once verified). With no ancestor reachable the node says
  ``detached`` in ``/healthz`` (a receiver may then fall back to the object store). A
  node also subscribes to its first parent at start, so a restarted node catches up,
  and again every ``resync_interval_s`` (anti-entropy: whatever it missed, through a
  refusal, a stall or exhausted re-sends, comes back). A forward that fails with a
  connection error or a 5xx is re-sent from staging ``retries`` times with doubling
  delays; an upload that brings no bytes for ``stall_timeout_s``, or does not end
  within ``size / min_upload_bytes_per_s`` plus one ``stall_timeout_s`` for the sender
  and one per child, is dropped (408): a hung or trickling sender cannot pin staging
  space. Duplicates from re-sends are dropped by id.
* **Ids are checked before they are used or logged.** Attempt ids in URLs and
  subscription bodies must match the attempt-id pattern (else 400); log lines quote
  request-derived text with ``repr``, so control characters cannot forge log lines. A
  payload's header is counted before it is parsed (:func:`dcr.format.payload.read_payload`:
  at most ``max_items`` items), so a small upload cannot cost seconds and hundreds of
  MiB to verify.

Endpoints (``Authorization: Bearer <token>`` on all but ``/healthz``, else 401; ``P``:
the publish token only, else 403; ``R``: either token)::

    PUT    /v1/payloads/{attempt}/{owner}/{seq}   P  201 queued | 200 duplicate | 400 | 408
                                                     | 409 | 410 deleted | 411 | 413 | 503
    GET    /v1/payloads/{attempt}/{owner}/{seq}   R  the bytes (404 if not staged)
    GET    /v1/attempts/{attempt}/payloads        R  {payloads: [{owner, seq, size, digest}],
           [?wait_s=S&known=TAG]                      manifest: {size, digest} | null, tag};
                                                     with wait_s (0-5), answers once the
                                                     listing's tag differs from TAG, or
                                                     after S seconds (a long poll)
    DELETE /v1/attempts/{attempt}                 P  drop it here and below: {dropped}
    PUT    /v1/manifests/{attempt}                P  as payloads; checked as a Manifest
    GET    /v1/manifests/{attempt}                R  the manifest bytes
    POST   /v1/subscribe                          P  {index, held: {attempt: [[owner, seq]]},
                                                      manifests: [attempt]} -> {replaying}
    GET    /v1/status                             R  health + counters + blobs still arriving
    GET    /healthz                                  {status: ok | detached, parent, children,
                                                      staged_bytes, memory_bytes, waiting, ...}

Not here: TLS (run it behind the cluster's mesh or add an ``ssl_context``), persistence
of staged bytes across restarts (a restarted node starts empty and is refilled by its
parent), tombstones for deleted attempts, and moving back under a recovered parent.
"""

from dcr.errors import RelayError, RelayNotFound
from dcr.transport.relay.client import RelayClient, StagedPayload
from dcr.transport.relay.node import RelayNode, run_relay, serve
from dcr.transport.relay.settings import RelaySettings
from dcr.transport.relay.source import RelaySource
from dcr.transport.relay.staging import Staging
from dcr.transport.relay.tree import (
    ancestors_of,
    children_of,
    depth_of,
    parent_of,
    parse_address,
    tree_depth,
)
from dcr.transport.relay.wire import Key

__all__ = [
    "Key",
    "RelayClient",
    "RelayError",
    "RelayNode",
    "RelayNotFound",
    "RelaySettings",
    "RelaySource",
    "StagedPayload",
    "Staging",
    "ancestors_of",
    "children_of",
    "depth_of",
    "parent_of",
    "parse_address",
    "run_relay",
    "serve",
    "tree_depth",
]
