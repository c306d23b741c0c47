"""The MXFP8 block: this many consecutive inputs share one E8M0 exponent (the OCP MX format).

Its own module so that the references (`fp8.py`) and the Triton kernels (`fp8_triton.py`) both
read it without importing each other."""

MX_BLOCK = 32
