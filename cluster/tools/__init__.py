"""Tools: what an operator runs around a job.

Here: the `mscluster` command (`cli`, thin over the library); the launcher (`launch`, the
supervisor), its decisions (`launch_policy`, pure: restart or not, who failed first, when the
job is over), what it shows at its terminal (`launch_echo`), its checks before anything starts
(`launch_setup`), what it starts (`launch_plan`, pure), the job secret it makes (`secret`) and
where its values come from (`placement`, pure: the options, a Slurm allocation read by `slurm`
with node lists by `hostlist`, and `slurm_io` for scontrol and the shared job secret); the
status view (`status`, live in `watch`, its tables in `table`), the event log reader (`events`),
how both prove the job secret (`reading`), fault injection (`chaos`, with what it records in
`chaos_record` and its picture in `timeline` and `report_html`) and the test harness (`testing`,
public as `cluster.testing`), and the guard that ends the processes of a job (the
launcher's, a test's) whose owner is gone, stopped ones too (`guard`).

May import: anything in `cluster`. Nothing in `cluster` imports the tools.
"""
