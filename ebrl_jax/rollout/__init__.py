"""Rollout: simulation and generation composed. `mjx` holds pure, jit-able scans for JAX-native simulators;
`cpu` drives native-MuJoCo env pools around a jitted `act`. Shared by the fused schedule and the rollout workers."""
