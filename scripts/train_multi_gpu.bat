@echo off
rem Train any config on several processes (GPUs) of this machine, or of several machines:
rem   scripts\train_multi_gpu.bat CONFIG [NPROC] [STAGE] ["key=value" overrides...]
rem STAGE (pretrain or sft) picks the VLM stage of a vlm_sft config: scripts\train_multi_gpu.bat configs\vlm_pretrain.yaml pretrain
rem Quote each override: cmd.exe splits unquoted arguments at "=". NPROC defaults to the number of
rem GPUs (1 without GPUs). A thin wrapper over `alignkit launch`: MASTER_PORT (default 29500, or a
rem free port if taken), NNODES, NODE_RANK, MASTER_ADDR and LAUNCHER pass through; PYTHON picks
rem the interpreter.
setlocal
rem SHIFT also shifts the script's own name and folder: keep both before any SHIFT
set "HERE=%~dp0"
set "ME=%~nx0"
set "CONFIG=%~1"
if "%CONFIG%"=="" goto usage
set "NPROC_ARGS="
set "STAGE_ARG="
shift
rem up to two leading arguments before the overrides: NPROC (a number) and/or a VLM STAGE (pretrain | sft)
:lead
if "%~1"=="" goto args
if "%~1"=="pretrain" if not defined STAGE_ARG (
  set "STAGE_ARG="vlm.stage=pretrain""
  shift
  goto lead
)
if "%~1"=="sft" if not defined STAGE_ARG (
  set "STAGE_ARG="vlm.stage=sft""
  shift
  goto lead
)
echo %~1| findstr /r "^[0-9][0-9]*$" >nul
if not errorlevel 1 if not defined NPROC_ARGS (
  set "NPROC_ARGS=--nproc-per-node %~1"
  shift
  goto lead
)
echo %~1| findstr /c:"=" >nul
if errorlevel 1 (
  echo %ME%: argument '%~1' is neither NPROC ^(a number^), a VLM stage ^(pretrain ^| sft^) nor a "key=value" override; other training stages are chosen in the config 1>&2
  exit /b 2
)
:args
call "%HERE%_launch_args.bat"
set "REST="
:collect
if "%~1"=="" goto run
set REST=%REST% %1
shift
goto collect
:run
"%PYTHON%" -m alignkit launch %NPROC_ARGS% %LAUNCH_ARGS% "%CONFIG%" %STAGE_ARG% %REST%
exit /b %ERRORLEVEL%
:usage
echo usage: %ME% CONFIG [NPROC] [STAGE] ["key=value" ...] 1>&2
exit /b 2
