@echo off
rem Flow-RTPO (configs\flow_rtpo.yaml, docs\workflows\redteam.md "Flow-RTPO"): the red-team attacker and the
rem flow-matching image policy trained together, on NPROC processes of this machine, through accelerate launch:
rem   scripts\train_flow_rtpo.bat NPROC ["key=value" overrides...]
rem Single node, 8 GPUs (the guide's `accelerate launch --num_processes 8 ...`):
rem   scripts\train_flow_rtpo.bat 8
rem Two nodes of 8 GPUs (the guide's --num_machines 2 --machine_rank R --main_process_ip ^<node0_ip^>):
rem   node 0: set NNODES=2 ^& set NODE_RANK=0 ^& set MASTER_ADDR=^<node0_ip^> ^& set MASTER_PORT=29500, then the script
rem   node 1: the same with NODE_RANK=1
rem NPROC is the processes PER NODE. Quote each override: cmd.exe splits unquoted arguments at "=". Set CONFIG
rem to use another recipe, LAUNCHER=torchrun instead of accelerate. Writes models\flow_rtpo (final\ the attacker,
rem final_image_policy\ the image policy, attacks.jsonl). A thin wrapper over `alignkit launch`; PYTHON picks
rem the interpreter.
setlocal
rem SHIFT also shifts the script's own name and folder: keep both before any SHIFT
set "HERE=%~dp0"
set "ME=%~nx0"
set "NPROC=%~1"
if "%NPROC%"=="" goto usage
if "%CONFIG%"=="" set "CONFIG=%HERE%..\configs\flow_rtpo.yaml"
if "%LAUNCHER%"=="" set "LAUNCHER=accelerate"
call "%HERE%_launch_args.bat"
set "REST="
shift
:collect
if "%~1"=="" goto run
set REST=%REST% %1
shift
goto collect
:run
"%PYTHON%" -m alignkit launch --nproc-per-node %NPROC% %LAUNCH_ARGS% "%CONFIG%" "output_dir=models/flow_rtpo" %REST%
exit /b %ERRORLEVEL%
:usage
echo usage: %ME% NPROC ["key=value" ...] 1>&2
exit /b 2
