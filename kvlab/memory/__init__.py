"""A rank's memory: the paged KV cache and its pools (``cache``), the fill that makes every byte
checkable (``fill``), the staging slots a transport copies through (``staging``), and the copy ops on the
CPU and as NVRTC kernels (``ops``). Imports kvlab.config, kvlab.model and kvlab.core."""
