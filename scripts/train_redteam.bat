@echo off
rem Red-team RL (configs\redteam.yaml, docs\workflows\redteam.md) on NPROC processes of this machine:
rem   scripts\train_redteam.bat NPROC ["key=value" overrides...]
rem Quote each override: cmd.exe splits unquoted arguments at "=". Set CONFIG to use another
rem recipe. Writes models\redteam (every attack, answer and score in models\redteam\attacks.jsonl).
rem A thin wrapper over `alignkit launch`: MASTER_PORT (default 29500, or a free port if taken), NNODES,
rem NODE_RANK, MASTER_ADDR and LAUNCHER pass through; PYTHON picks the interpreter.
setlocal
rem SHIFT also shifts the script's own name and folder: keep both before any SHIFT
set "HERE=%~dp0"
set "ME=%~nx0"
set "NPROC=%~1"
if "%NPROC%"=="" goto usage
if "%CONFIG%"=="" set "CONFIG=%HERE%..\configs\redteam.yaml"
call "%HERE%_launch_args.bat"
set "REST="
shift
:collect
if "%~1"=="" goto run
set REST=%REST% %1
shift
goto collect
:run
"%PYTHON%" -m alignkit launch --nproc-per-node %NPROC% %LAUNCH_ARGS% "%CONFIG%" "output_dir=models/redteam" %REST%
exit /b %ERRORLEVEL%
:usage
echo usage: %ME% NPROC ["key=value" ...] 1>&2
exit /b 2
