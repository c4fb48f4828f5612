@echo off
rem Called by the train_*.bat scripts: turns the multi-node environment variables users already
rem set (torchrun's names) into `alignkit launch` options in LAUNCH_ARGS. Unset variables keep
rem alignkit's defaults (one node; port 29500, or a free one when 29500 is taken on one node).
set "LAUNCH_ARGS="
if defined NNODES set "LAUNCH_ARGS=%LAUNCH_ARGS% --nnodes %NNODES%"
if defined NODE_RANK set "LAUNCH_ARGS=%LAUNCH_ARGS% --node-rank %NODE_RANK%"
if defined MASTER_ADDR set "LAUNCH_ARGS=%LAUNCH_ARGS% --master-addr %MASTER_ADDR%"
if defined MASTER_PORT set "LAUNCH_ARGS=%LAUNCH_ARGS% --master-port %MASTER_PORT%"
if defined LAUNCHER set "LAUNCH_ARGS=%LAUNCH_ARGS% --launcher %LAUNCHER%"
if not defined PYTHON set "PYTHON=python"
exit /b 0
