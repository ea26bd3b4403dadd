"""Resource management for the process schedules: the MPS daemon and SM quotas (`mps`), CPU cores (`cpus`), GPU
memory (`memory`), telemetry (`telemetry`), stage profiles (`profiles`), calibration (`calibrate`) and the
planner (`planner`, `autoplan`)."""
