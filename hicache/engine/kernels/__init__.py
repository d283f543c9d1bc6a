"""The engine's own GPU kernels (Triton, with PyTorch references): paged decode attention (decode.py), prefill
attention over a cached prefix (prefill.py), and fused elementwise ops (fused.py)."""
