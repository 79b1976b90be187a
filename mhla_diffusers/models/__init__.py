"""The diffusers integration of MHLA: model families, token-grid hooks, the attention processor,
installing / removing MHLA on a transformer, and which layers get it (hybrid selection)."""
