"""Device-specific implementations behind the model's reference math, and the measured choices
between them.

`sgraf.model` holds the paper's equations as plain PyTorch (what every test holds the fast
paths to). This package holds what depends on the machine: `cpu` (float32 and bf16 matmuls
through oneDNN or PyTorch's own route, whichever this processor runs faster), `tuning`
(probes that time the candidates once per machine and remember the winner), `plan` (whether a
device gets the CPU's or the GPU's plan of work, and the GPU plan emulated on CPU tensors),
`launches` (the kernel launches of a piece of work, counted without a GPU), `edges` (SGR's eval
edge step by batched matmuls or PyTorch's fused attention, whichever this device runs faster),
the eval block's Triton kernels beside their eager routes (`words`: the word and global nodes;
`attention`; `graph_steps`: SGR's reasoning steps; `filtration`: SAF's filter), chosen per device
by `fused_routes`, `norms` (their eager routes' l2 norm), `gru` (the caption GRU's training pass
on the CPU), `nodes` (a training chunk's word nodes, keeping no (word x feature) tensor for
backward), `eval_chunks` and `train_chunks` (how an eval block and a training batch are cut
into chunks, and what a training chunk keeps for backward), `memory` (glibc's allocator kept
from returning freed memory), `compiled`
(`torch.compile` of the eval chunk, the training pairs and the bf16 nodes' passes) and `packing`
(the GRU's packed order with one gather). Nothing here imports the model, the scorer or anything
above them.
"""
