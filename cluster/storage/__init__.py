"""Storage: bytes that must survive a crash.

Here: the one atomic file write (`atomic`: temporary file, fsync, rename, fsync of the
directory, every OSError turned into the caller's error in one place); the state store interface
with compare-and-set (`state_store`) and its directory implementation under MS_RECOVERY_PATH
(`directory_store`, over `store`: versioned, checksummed files with the directory lock); the
key-value store's append-only log (`kv_log`); and the checkpoint files: the state's encoding
(`checkpoint_tree`), the file format with its checksum (`checkpoint_files`), a step held in
memory in reused buffers (`snapshot`), the thread that writes them in the background
(`background`), the lock that keeps a rank's files of a prefix to one manager
(`checkpoint_lock`), and what a worker offers to peers that take a rank without its checkpoints
(`served`: files as on disk, a step in memory copied only when replaced mid-transfer).

May import: `cluster.protocol`, numpy, xxhash and the standard library (torch only when a state
holds tensors). Never grpc, the scheduler, the worker, the training API or anything above them.
"""
