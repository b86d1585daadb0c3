"""Moving payloads and manifests between owners and receivers."""
