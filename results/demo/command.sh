# The demo's command line: what `make demo` runs, what demo.txt is the printed output of, and what
# tests/experiments/test_results.py runs in CI and compares with demo.txt (timings aside). --precision fp32: the same
# figures on every CPU (auto trains in bf16 where the CPU has it natively, and bf16 changes the last digits).
crispedit demo --precision fp32
