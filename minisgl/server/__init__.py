"""The serving daemon: configuration (args), process tree (launch, proc), HTTP API (api,
protocol, responses, streams, metrics) and the terminal chat (shell).
Entry point: `minisgl.server.launch.main`."""
