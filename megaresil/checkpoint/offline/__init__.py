"""Single-process work on checkpoints, with no training running: inspecting
and verifying (inspect.py), comparing (diff.py), converting to another layout
or backend (convert.py), and the streamed writer they share (writer.py, with
planning.py for the target layout's rects and ondemand.py for data produced
as it is written). Importing this package imports nothing: `ckpt inspect`
stays torch-free."""
