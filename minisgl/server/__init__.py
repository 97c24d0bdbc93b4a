"""The serving daemon: configuration (args, topology), process tree (launch, service, proc),
the nodes of a multi-node service (cluster), HTTP API (api, protocol, responses, streams,
metrics, tools and tool_calls) and the terminal chat (shell). Entry point:
`minisgl.server.launch.run`."""
