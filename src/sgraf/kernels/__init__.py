"""Device-specific implementations behind the model's reference math, and the measured choices
between them.

`sgraf.model` holds the paper's equations as plain PyTorch (what every test holds the fast
paths to). This package holds what depends on the machine: `cpu` (float32 and bf16 matmuls
through oneDNN or PyTorch's own route, whichever this processor runs faster), `tuning`
(probes that time the candidates once per machine and remember the winner), `plan` (whether a
device gets the CPU's or the GPU's plan of work, and the GPU plan emulated on CPU tensors),
`launches` (the kernel launches of a piece of work, counted without a GPU), `edges` (SGR's eval
edge step by batched matmuls or PyTorch's fused attention, whichever this device runs faster)
and `packing` (the GRU's packed order with one gather). Nothing here imports the model, the
scorer or anything above them.
"""
