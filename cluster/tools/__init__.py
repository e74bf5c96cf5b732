"""Tools: what an operator runs around a job.

Here: the `mscluster` command (`cli`, thin over the library), the launcher (`launch`), the
status view (`status`), fault injection (`chaos`) and the test harness (`testing`, public as
`cluster.testing`).

May import: anything in `cluster`. Nothing in `cluster` imports the tools.
"""
