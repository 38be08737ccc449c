"""The device proxy: a server per device and the in-job client that forwards device work to it."""
