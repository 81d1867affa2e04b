"""What is measured: one training step, the live-tensor tracker and allocator counters, the timing
protocol, `measure`, `compare_gradients`, and sharded (FSDP2) measurement."""
