"""Worker side: paged CUDA kernels (and their CPU twins) that read and write the KV cache."""
