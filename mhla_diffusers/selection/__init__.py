"""Which self-attention layers get MHLA: fixed rules, the attention-cost model, per-layer sensitivity
and its calibration inputs. Imported on use by :func:`~mhla_diffusers.apply_mhla`; see ``docs/selection.md``.
"""
