"""Neuro-plastic layers: chosen decoder layers whose FFN weights are modulated per token by that token's attention
output through a low-rank factorisation, W + A diag(m(token)) B (see npt.modulated).

Modules: modulated (NPComponent, NPBlock, modulated_linear), convert (convert, modes, fold), adapters (save/load the NP
parameters), equivalence (the equivalence loss), memory (live-bytes tracker and full-size memory check). Training
the NP layers to reproduce the dense model is train_npt.py.
"""

from npt.adapters import load_adapters, save_adapters
from npt.convert import convert, fold, np_blocks, np_parameters, revert, set_mode, set_offload, using_mode
from npt.modulated import NPBlock, NPComponent, modulated_linear

__all__ = ["NPBlock", "NPComponent", "convert", "fold", "load_adapters", "modulated_linear", "np_blocks",
           "np_parameters", "revert", "save_adapters", "set_mode", "set_offload", "using_mode"]
