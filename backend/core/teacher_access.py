"""Which teacher endpoints and API keys a web UI user may use (issue #25, parts 2 and 4). Light (no torch,
no httpx): the UI imports it; the distill backend imports it too.

The decision:

- **Keys come from the operator.** A UI user never names an arbitrary environment variable of the server:
  the operator lists the ones offered at start, each bound to one base URL,
  `tuneboard webui --teacher-key-env NAME=BASE_URL` (repeatable). The key in `$NAME` is only ever sent to
  that base URL (the same scheme, host, port and path, after normalisation). A key file is the user's own
  choice, read only from the UI's allowed folders (backend.core.allowed.check_read). No key at all is always fine.
- **No internal addresses.** A teacher URL whose host resolves (every address of it, IPv4 and IPv6) to a
  loopback, link-local, private, unique-local, unspecified or otherwise non-global address (127/8, ::1,
  169.254/16, fe80::/10, 10/8, 172.16/12, 192.168/16, fc00::/7, 100.64/10, 0.0.0.0, ...) is refused, unless
  the operator allowed that base URL: `tuneboard webui --allow-teacher-url URL` (repeatable). A base URL
  bound to a key by `--teacher-key-env` counts as allowed too (the operator named it). A host that does not
  resolve is refused (nothing to check). The teacher the run starts itself (`teacher: local`, a
  `tuneboard api` on loopback) is not a URL the user gives, so none of this applies to it.
- **Who is checked.** The UI checks every distill spec before it launches one (webui/tabs/distill.py shows
  one line naming the field). `webui/app.py main()` hands the operator's lists to the UI's subprocesses in
  environment variables (as backend.core.allowed does with TUNEBOARD_ALLOW_PATHS) and sets POLICY_ENV, so the
  distill backend checks again, and its HTTP client refuses to connect to a non-global address at connect
  time (a host name that changed its answer since the check). Without POLICY_ENV (a CLI user, who owns the
  environment anyway) the backend does not restrict.
- **Always, for everybody:** the teacher client follows no redirect (backend.distill.teacher), so the
  Authorization header never leaves for another URL than the one the key was configured with.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from urllib.parse import urlsplit

from backend.core import allowed

POLICY_ENV = "TUNEBOARD_TEACHER_POLICY"  # "webui": the UI started this process; the checks apply
KEYS_ENV = "TUNEBOARD_TEACHER_KEYS"      # NAME=BASE_URL entries separated by whitespace
URLS_ENV = "TUNEBOARD_TEACHER_URLS"      # base URLs separated by whitespace
POLICY_WEBUI = "webui"
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class TeacherRefused(ValueError):
    """A teacher URL or key source the UI may not use. `what`: key_env (a variable the operator does not
    offer), key_url (offered, but for another base URL), private (a non-global address), unresolved (the
    host has no address), url (not an http(s) base URL). `field`: the spec key; kwargs fill the locale
    message distill.refused_<what>."""

    def __init__(self, what: str, field: str, **kwargs):
        self.what, self.field, self.kw = what, field, {k: str(v) for k, v in kwargs.items()}
        super().__init__(f"{field}: {self.english()}")

    def key(self) -> str:
        return f"distill.refused_{self.what}"

    def kwargs(self) -> dict:
        return dict(self.kw)

    def english(self) -> str:
        k = self.kw
        return {
            "key_env": f"${k.get('name')} is not a key this server offers (offered: {k.get('offered')}); the "
                       "server's operator offers one with `tuneboard webui --teacher-key-env NAME=BASE_URL`",
            "key_url": f"the key in ${k.get('name')} is only sent to {k.get('bound')}, not to {k.get('url')}",
            "private": f"{k.get('host')} is {k.get('address')}, an internal address (loopback, link-local or "
                       "private): the server's operator can allow this base URL with "
                       "`tuneboard webui --allow-teacher-url URL`",
            "unresolved": f"{k.get('host')} does not resolve to an address",
            "url": f"{k.get('url')} is not an http(s) base URL without user name, query or fragment",
        }[self.what]


# ------------------------------------------------------------------------------------ the URL itself
def normalize_url(url: str) -> str:
    """`scheme://host[:port]/path` lower-cased where case does not matter, the default port and a trailing
    slash dropped; ValueError for anything else than a plain http(s) base URL."""
    text = str(url or "").strip()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text}: bad port") from None
    if scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password \
            or parts.query or parts.fragment or any(c.isspace() for c in text):
        raise ValueError(f"{text}: not an http(s) base URL without user name, query or fragment")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    if port is not None and port != {"http": 80, "https": 443}[scheme]:
        host = f"{host}:{port}"
    return f"{scheme}://{host}{parts.path.rstrip('/')}"


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme.lower() == "https" else 80)


def is_public(address: str) -> bool:
    """A global unicast address (an IPv4-mapped IPv6 address is judged as its IPv4 one)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (an IP literal, in any form inet_aton takes, is its own); OSError
    when it resolves to none."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


# ------------------------------------------------------------------------- the operator's lists (env)
def restricted() -> bool:
    """Whether this process runs for the web UI (set by `tuneboard webui`): the backend checks then."""
    return os.environ.get(POLICY_ENV) == POLICY_WEBUI


def offered_keys() -> dict[str, str]:
    """{variable name: the base URL its key may be sent to} from the operator's --teacher-key-env."""
    out = {}
    for entry in os.environ.get(KEYS_ENV, "").split():
        name, _, url = entry.partition("=")
        try:
            out[name] = normalize_url(url)
        except ValueError:
            continue  # not ours to repair: configure() never writes one
    return out


def allowed_urls() -> set[str]:
    """Base URLs the operator allowed even on an internal address (--allow-teacher-url, and the URLs bound
    to offered keys)."""
    out = set(offered_keys().values())
    for url in os.environ.get(URLS_ENV, "").split():
        try:
            out.add(normalize_url(url))
        except ValueError:
            continue
    return out


def parse_key_flag(text: str) -> tuple[str, str]:
    """`NAME=BASE_URL` -> (NAME, normalized URL); ValueError naming what is wrong."""
    name, sep, url = str(text).partition("=")
    if not sep or not NAME_RE.match(name.strip()):
        raise ValueError(f"{text!r}: expected NAME=BASE_URL (NAME: an environment variable name)")
    return name.strip(), normalize_url(url)


def configure(key_flags: list[str], url_flags: list[str]) -> None:
    """Writes the operator's lists (merged with what the environment already holds) and POLICY_ENV into
    os.environ, for this process and every process it starts. ValueError for a bad entry or a variable
    bound to two URLs."""
    keys = offered_keys()
    for flag in key_flags:
        name, url = parse_key_flag(flag)
        if keys.get(name, url) != url:
            raise ValueError(f"{name} is bound to {keys[name]} already: a key goes to one base URL only")
        keys[name] = url
    urls = [u for u in os.environ.get(URLS_ENV, "").split() if u]
    for flag in url_flags:
        url = normalize_url(flag)
        if url not in urls:
            urls.append(url)
    os.environ[KEYS_ENV] = " ".join(f"{n}={u}" for n, u in keys.items())
    os.environ[URLS_ENV] = " ".join(urls)
    os.environ[POLICY_ENV] = POLICY_WEBUI


# ----------------------------------------------------------------------------------------- checks
def check_url(url: str, field: str = "teacher") -> list[TeacherRefused]:
    """[] when `url` may be asked: an operator-allowed base URL, or a host whose every address is global."""
    try:
        norm = normalize_url(url)
    except ValueError:
        return [TeacherRefused("url", field, url=url)]
    if norm in allowed_urls():
        return []
    host, port = host_port(norm)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError):
        return [TeacherRefused("unresolved", field, host=host)]
    inner = [a for a in addresses if not is_public(a)]
    return [TeacherRefused("private", field, host=host, address=inner[0])] if inner else []


def check_key(url: str, key_env: str | None, key_file: str | None,
              field: str = "teacher_api_key_env") -> list[TeacherRefused]:
    """[] when the key source may be used with `url`: no key, a key file (its folder is backend.core.allowed's
    business), or an offered variable bound to this very base URL."""
    name = (key_env or "").strip()
    if key_file or not name:
        return []
    offered = offered_keys()
    if name not in offered:
        listed = ", ".join(f"{n} ({u})" for n, u in offered.items()) or "none"
        return [TeacherRefused("key_env", field, name=name, offered=listed)]
    try:
        same = normalize_url(url) == offered[name]
    except ValueError:
        same = False
    return [] if same else [TeacherRefused("key_url", field, name=name, bound=offered[name], url=url)]


def check_teacher(url: str, key_env: str | None, key_file: str | None, prefix: str = "teacher",
                  url_field: str | None = None) -> list[TeacherRefused]:
    """Every refusal of a teacher (or any other OpenAI-compatible endpoint: `prefix` names its spec keys,
    <prefix> (or `url_field`) and <prefix>_api_key_env) the UI asks for; 'local' (the run's own `tuneboard api`)
    is fine."""
    if url == "local":
        return []
    return check_url(url, url_field or prefix) + check_key(url, key_env, key_file, f"{prefix}_api_key_env")


def endpoint_refusals(url: str, key_env: str | None, key_file: str | None, prefix: str = "teacher",
                      url_field: str | None = None) -> list[ValueError]:
    """check_teacher's refusals, and a key file (<prefix>_api_key_file) outside the folders the UI may read
    (backend.core.allowed): what a process the web UI started checks before it asks the endpoint."""
    refused: list[ValueError] = list(check_teacher(url, key_env, key_file, prefix, url_field))
    if key_file:
        try:
            allowed.check_read(key_file, f"{prefix}_api_key_file")
        except allowed.PathRefused as exc:
            refused.append(exc)
    return refused


def error_line(body: bytes | str, fallback: str) -> str:
    """An endpoint's error body as one line of at most 300 characters: OpenAI's {"error": {"message"}} or
    {"error": "..."}, FastAPI's {"detail"}, else the text itself; `fallback` (the reason phrase) when empty.
    The teacher client, the judge's and the reward endpoint's callers name a refusal with it."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        found = err.get("message") if isinstance(err, dict) else err or data.get("detail")
        text = str(found) if found else text
    return " ".join(text.split())[:300] or fallback
