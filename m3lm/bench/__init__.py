"""`m3lm bench` and the library the benchmark scripts share: the release-dimension slice
(`slice`), GPU timing (`timing`), rows, floors and reports (`report`), the attention case
(`attention`), the GPU's energy and clocks (`gpu_meter`) and the transformers reference
(`hf_reference`); `run` is the command."""
