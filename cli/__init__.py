"""kvfs.cli: the `kvfs` command (local cluster, admin commands, the demo) and the
launcher that starts kvfs servers as processes, shared by `kvfs cluster up`,
`kvfs-bench` and the tests."""
