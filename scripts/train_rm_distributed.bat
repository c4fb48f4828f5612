@echo off
rem Train the Helpful-RM (reward model on helpful pairs) or the Harmless-RM (cost model on safety
rem pairs) on NPROC processes of this machine:
rem   scripts\train_rm_distributed.bat helpful|harmless NPROC ["key=value" overrides...]
rem Quote each override: cmd.exe splits unquoted arguments at "=".
rem Writes models\<task>_rm (relative to the current directory). A thin wrapper over `alignkit launch`:
rem MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and LAUNCHER
rem pass through; PYTHON picks the interpreter.
setlocal
rem SHIFT also shifts the script's own name and folder: keep both before any SHIFT
set "HERE=%~dp0"
set "ME=%~nx0"
set "TASK=%~1"
set "NPROC=%~2"
if "%TASK%"=="" goto usage
if "%NPROC%"=="" goto usage
if /I not "%TASK%"=="helpful" if /I not "%TASK%"=="harmless" goto usage
call "%HERE%_launch_args.bat"
set "REST="
shift
shift
:collect
if "%~1"=="" goto run
set REST=%REST% %1
shift
goto collect
:run
"%PYTHON%" -m alignkit launch --nproc-per-node %NPROC% %LAUNCH_ARGS% "%HERE%..\configs\rm_%TASK%.yaml" "output_dir=models/%TASK%_rm" %REST%
exit /b %ERRORLEVEL%
:usage
echo usage: %ME% helpful^|harmless NPROC ["key=value" ...] 1>&2
exit /b 2
