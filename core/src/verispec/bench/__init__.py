"""`verispec bench`: plain vs speculative decoding on named scenarios (their prompts: `verispec/scenarios/`).

- `run`: the timed bench: each scenario plain then speculative in one process, token streams compared,
  a table or JSON (`load_scenarios`, `run_scenario`, `compare`, `run_bench`).
- `diagnostic`: `--diagnostic`: the speculative path's rows, teacher-forced, against plain decoding's
  (tells a state bug from kernel arithmetic).
- `plot`: `--plot FILE.png`: the bench rows and one scenario's per-step trace (matplotlib, optional).
"""
