"""How radixrt starts: cli (the `radixrt` console script), launch_server (one server + drain), data_parallel (servers behind sglang-router), tp_node (a node's tensor-parallel ranks), demo."""
