"""fp16 SGD is never fused where torch's fused SGD would corrupt its momentum."""
from __future__ import annotations

import torch


def test_fp16_sgd_is_never_fused_where_torch_s_fused_sgd_would_corrupt_its_momentum():
    """fp16's GradScaler skips a step whose gradients overflowed (routine in the first steps). torch's fused SGD
    (the kernel optim.fused picks on GPUs) still moves its momentum on such a step, and the weights go NaN a step
    later (seen on an H200: the fp16 ResNet test's loss was NaN): optim.build does not fuse SGD with momentum
    under loss scaling (test_training's fp16 GPU test runs that choice), and config.validate refuses
    optim.fused=true there. This checks the torch behaviour the rule stands on (fused kernels run on the CPU
    too): once a torch fixes it, this fails and the rule can go."""
    def after_an_overflow(fused: bool) -> list:
        m = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(m(torch.full((2, 4), 3e38)).sum()).backward()  # inf gradients: the step is skipped
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return [opt.state[p].get("momentum_buffer") for p in m.parameters()]

    # Unfused, a skipped step makes no momentum; fused, it makes buffers it never writes (empty_like), which the
    # next step reads as the momentum so far: garbage, NaN on a GPU. (Their contents vary: the check is that they
    # exist.)
    assert after_an_overflow(False) == [None, None]
    assert all(torch.is_tensor(b) for b in after_an_overflow(True))  # torch's bug: still there
