"""Device-specific implementations behind the model's reference math, and the measured choices
between them.

`sgraf.model` holds the paper's equations as plain PyTorch (what every test holds the fast
paths to). This package holds what depends on the machine: `cpu` (float32 and bf16 matmuls
through oneDNN or PyTorch's own route, whichever this processor runs faster) and `tuning`
(probes that time the candidates once per machine and remember the winner). Nothing here
imports the model, the scorer or anything above them.
"""
