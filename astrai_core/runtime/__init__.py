"""What every part of the core runs on: the environment every entry point applies (env), files written in place
(io), child processes (proc), progress lines (progress), the one error type (errors), and where this process
computes (device)."""
