"""TLS on the HTTP port (vLLM's and SGLang's --ssl-keyfile / --ssl-certfile), and the URLs and
loopback requests that depend on it.

With a key and a certificate the API server speaks HTTPS only (uvicorn's TLS); the launcher's
ready line, `--shell` and `--batch-input` then use https:// as well. The service's own requests
to itself (the shell, batch files, the Batch API) go to its loopback address, which the
certificate does not name (it names the public host): they skip verification, since the peer is
this process on this machine.
"""

from __future__ import annotations

import ssl
import urllib.request
from typing import Any, Optional, Tuple


def check_tls(keyfile: Optional[str], certfile: Optional[str]) -> Optional[Tuple[str, str]]:
    """(keyfile, certfile) where both are given, None where neither is; ValueError naming the
    setting or the file where only one is, or where they do not load as a certificate chain
    and its key (ssl's own reason)."""
    if keyfile is None and certfile is None:
        return None
    if keyfile is None or certfile is None:
        given = "ssl_keyfile" if keyfile is not None else "ssl_certfile"
        raise ValueError(f"{given} needs its partner: ssl_keyfile and ssl_certfile go together")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"ssl_certfile {certfile} with ssl_keyfile {keyfile} do not load as a "
                         f"certificate and its key: {e}") from None
    return keyfile, certfile


def server_url(host: str, port: int, tls: bool) -> str:
    """The URL of a server at `host` (an IPv6 address bracketed) and `port`."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{'https' if tls else 'http'}://{where}"


def loopback_open(req: urllib.request.Request, timeout: float) -> Any:
    """urlopen of a request to this service's own loopback URL: over HTTPS without verifying
    the certificate (module doc)."""
    context = ssl._create_unverified_context() if req.full_url.startswith("https:") else None
    return urllib.request.urlopen(req, timeout=timeout, context=context)
