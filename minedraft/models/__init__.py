"""Model folders: the bundled pairs (sub-folders, package data), named pairs pulled from the package registry
(hub.py), the checks a model folder must pass before any worker starts (check.py), and the distillation data
the training scripts share (distill.py)."""
