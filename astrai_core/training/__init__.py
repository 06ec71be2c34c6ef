"""The training core: the loop (train), what it builds for a parallel layout (parallel), its launch and rank setup
(distributed), run configs (config), strategies, callbacks, the optimizer (optim), rewards and the metric log."""
