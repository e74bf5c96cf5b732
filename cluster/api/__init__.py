"""The training API: what a training script calls.

Here: the process-wide membership behind `cluster.init()` (`runtime`), the one-line error
printer (`excepthook`), control-plane collectives and the key-value store (`collective`),
checkpoints (`checkpoint`, with its writer's and reporter's jobs in `checkpoint_writing` and
a rank's files in `checkpoint_listing`, and `peer_state`: this process's state server and
fetching a checkpoint from a live peer), the recoverable training loop (`training`), its
optional Prometheus metrics (`worker_metrics`) and the torch data plane (`torch`, public as
`cluster.torch`).

May import: the scheduler and worker shells and everything below them. Never the tools.
"""
