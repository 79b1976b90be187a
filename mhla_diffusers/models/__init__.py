"""The diffusers integration of MHLA: model families, token-grid hooks, the attention processor,
installing / removing MHLA on a transformer (which layers get it: :mod:`mhla_diffusers.selection`)."""
