"""The run file, shared by the recording and the reading wings (docs/run-file.md): the Parquet
schema and footer keys (``schema``), the histogram column (``hist_column``), the fine bins of the
FP8 histograms (``fine_bins``), one segment's footer read and checked (``segment``) and the
segment names, the directory listing and which run is the latest (``names``).

It imports neither wing, nor torch: the writer and the reader share only this format."""
