"""Native CPU kernels (optional; the PyTorch paths remain the reference and the fallback)."""
