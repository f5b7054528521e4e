"""The cluster in a box: hosts as network namespaces (`cluster_box`), a real Slurm on
them (`slurm_box`)."""
