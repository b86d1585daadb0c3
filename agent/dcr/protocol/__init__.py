"""The refit protocol's torch-free core: attempts, their states, the commit record.

Shared by the agent, the encoder, the local coordinator and the Kubernetes operator
(which must never import torch).
"""
