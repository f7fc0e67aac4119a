"""The demo (``tools/demo.py``): a small generated dataset and its mmseg dataset class.

Importing this package (e.g. through ``custom_imports``) registers ``MesaDemoDataset``.
"""
from .dataset import CLASSES, PALETTE, MesaDemoDataset, make_scene, write_demo_dataset

__all__ = ['CLASSES', 'PALETTE', 'MesaDemoDataset', 'make_scene', 'write_demo_dataset']
