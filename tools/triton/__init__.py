"""Tools of the Triton backend: offline compiles for GPU targets (resource tables, trial switches,
specializations) and the host-path timing with launches stubbed. See README.md beside this file."""
