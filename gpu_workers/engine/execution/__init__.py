"""Running a scheduled batch on the model: inputs and KV cache (``model_runner``), decode CUDA graphs
(``cuda_graphs``) and token sampling (``sampler``)."""
