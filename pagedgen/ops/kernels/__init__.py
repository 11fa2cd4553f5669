"""The device code: the native C kernels and their builder, the Triton kernels, and the CPU they run on."""
