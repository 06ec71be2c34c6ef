"""The training core: the loop (train), what it builds for a parallel layout (parallel), its launch and rank setup
(distributed), run configs (config), strategies, callbacks, the optimizer (optim), rewards and the metric log."""

import os

# This process's parent as it starts, read before anything imports torch (seconds): a torchrun rank compares it with
# its parent once it has asked to die with it (distributed.die_with_launcher).
PARENT_AT_START = os.getppid()
