"""The main job's launcher: config (`job_config`, no ML import), process commands and
environments (`commands`), child processes (`processes`) and signals (`interrupt`), the
serving stack (`stack`), data, evaluation, reporting, and the job itself (`job.run_job`)."""
