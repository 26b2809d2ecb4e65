"""One trace file -> one rank's events table: which files (files), their JSON (document), foreign
vocabularies (nccl, megatron_names, comm_kernels, p2p_args), the table (schema, frame, compact),
its cache (store, columnar) and the parallel parse that alone composes them (load, cluster)."""
