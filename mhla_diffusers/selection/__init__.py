"""Which self-attention layers get MHLA: fixed rules (``hybrid``: "all", the paper's hybrid, a list),
the attention-cost model, per-layer sensitivity to MHLA and the calibration inputs it is measured on.

Built on the diffusers integration (:mod:`mhla_diffusers.models`); nothing there imports this
package except :mod:`mhla_diffusers.models.install`, whose :func:`~mhla_diffusers.apply_mhla` turns
``layers=`` into layer indices here. Modules are imported on use (``import mhla_diffusers.selection``
imports no torch model code).
"""
