"""What a plan costs on a device: device profiles, the per-node and per-copy cost model, and the simulators that replay a program or a runtime trace on a profile."""
