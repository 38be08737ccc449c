"""The proxy server of one device: holds the jobs' tensors and runs their operations in order.

Run as `python -m singularity.proxy.server --socket PATH --device-index N --memory-bytes B
[--cuda-device K]`. Without --cuda-device the device is virtual: tensors live in the server's
memory and operations run on its CPU. Modules: session (what a job process holds, memory
accounting), executor (running operations and requests), service (the Server: admission and
job connections), control (the daemon's requests) and __main__ (the command line).
"""
