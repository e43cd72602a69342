"""Device code both kernels call: masks, the softmax row rules, LSE and empty rows, exp2 on the
FMA pipe, the tile scheduler, pack-GQA views and the shared-storage struct; and the split-KV
merge rule (`merge`), which the combine kernel (`fa4lab.kernels.combine`) calls.

`python -m fa4lab.kernels.sharing` counts how much of the sm100 kernel this is, and so runs in
the sm90 kernel on a Hopper GPU.
"""
