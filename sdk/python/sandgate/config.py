"""Where the SDK's settings come from, the way the `sandgate` CLI takes them (cli/settings.h, cli/sandgate.cc),
so a script that works with the CLI works with the SDK. Each setting is the first of: the explicit
argument, its environment variable, the ingress file next to the node socket (for the ingress, CA file and
domain), then the CLI's default.

- api:      SANDGATE_API      unix:/path/node.sock | http://127.0.0.1:PORT | https://api.DOMAIN[:PORT]
- token:    SANDGATE_TOKEN    the operator token (the https/http API needs it; it also opens every sandbox)
- cacert:   SANDGATE_CACERT   CA file for the ingress's certificate; none: the system's trust store
- ingress:  SANDGATE_INGRESS  HOST:PORT where sandgate-proxy listens (for an https API, the address dialled
                              instead of the URL's host, as the CLI's --connect-to)
- domain:   SANDGATE_DOMAIN   the sandbox domain (an https API's host names it: api.DOMAIN)

Sandbox tokens are saved like the CLI saves them: <config home>/sandgate/tokens/<name or id>, one line, mode
0600 in 0700 directories, written to a temp file and renamed; <config home> is $XDG_CONFIG_HOME if absolute,
else $HOME/.config."""
import dataclasses
import os
import pwd
import re
import urllib.parse

from .errors import InvalidArgumentError, NotFoundError, SandgateError

DEFAULT_API = "unix:/run/sandgate/node.sock"
DEFAULT_INGRESS = "127.0.0.1:8443"
DEFAULT_DOMAIN = "sandbox.localhost"
INGRESS_FILE_NAME = "ingress"
MAX_TOKEN_FILE_BYTES = 4096        # as the CLI (cli/ssh.cc)
MAX_INGRESS_FILE_BYTES = 64 * 1024  # as the CLI (cli/settings.cc)
MAX_TOKEN_CHARS = 512              # the ingress's limit (docs/limits.md)

_ID = re.compile(r"sb-[a-z0-9]{12}")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token


def validate_ref(ref):
    """A sandbox id (sb- + 12 of a-z0-9) or name (a DNS label, as the node's names.cc checks), else
    InvalidArgumentError: a ref goes into host names, URL paths and a file name."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgumentError(f"a sandbox name or id is a non-empty string, got {ref!r}")
    if _ID.fullmatch(ref):
        return ref
    if not _LABEL.fullmatch(ref):
        raise InvalidArgumentError(
            f"'{ref}' is not a sandbox name or id: names are 1-63 of a-z, 0-9 and '-', not starting or ending "
            "with '-'")
    return ref


def validate_token(token, what="token"):
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise InvalidArgumentError(f"the {what} is empty or malformed (1-{MAX_TOKEN_CHARS} characters of an "
                                   "RFC 6750 token)")
    return token


def parse_host_port(text, what):
    """"HOST:PORT" or "[IPV6]:PORT" -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        close = text.find("]:")
        if close < 0:
            raise InvalidArgumentError(f"invalid {what} '{text}' (expected HOST:PORT or [IPV6]:PORT)")
        host, port = text[1:close], text[close + 2:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise InvalidArgumentError(f"invalid {what} '{text}' (expected HOST:PORT or [IPV6]:PORT)")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"invalid {what} '{text}' (expected HOST:PORT with a port 1-65535)")
    return host, int(port)


def dial_host(host):
    """localhost and *.localhost dial loopback without asking the resolver (RFC 6761, as curl and the CLI
    do): glibc does not resolve subdomains of localhost."""
    h = host.lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return "127.0.0.1"
    return host


@dataclasses.dataclass(frozen=True)
class ApiAddress:
    kind: str           # "unix", "http" or "https"
    path: str = ""      # unix
    host: str = ""      # http / https: the URL's host (for https the name the certificate must carry)
    port: int = 0

    def __str__(self):
        if self.kind == "unix":
            return "unix:" + self.path
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}://{host}:{self.port}"


def parse_api_address(text):
    """The CLI's --api / SANDGATE_API forms: unix:/abs/path, http://LOOPBACK:PORT[/], https://HOST[:PORT][/]."""
    hint = "(expected unix:/path/node.sock, http://127.0.0.1:PORT or https://api.DOMAIN[:PORT])"
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path.startswith("/"):
            raise InvalidArgumentError(f"invalid API address '{text}': the socket path must be absolute {hint}")
        return ApiAddress("unix", path=path)
    for scheme in ("http", "https"):
        prefix = scheme + "://"
        if text.startswith(prefix):
            rest = text[len(prefix):]
            if rest.endswith("/"):
                rest = rest[:-1]
            if "/" in rest or "?" in rest or "@" in rest or not rest:
                raise InvalidArgumentError(f"invalid API address '{text}': only a host and port {hint}")
            if rest.startswith("[") or rest.count(":") == 1:
                host, port = parse_host_port(rest, "API address")
            elif scheme == "https":
                host, port = rest, 443
            else:
                raise InvalidArgumentError(f"invalid API address '{text}': http needs a port {hint}")
            if scheme == "http" and host not in ("127.0.0.1", "::1", "localhost"):
                raise InvalidArgumentError(
                    f"invalid API address '{text}': plain http only on loopback (the node API's TCP listener); "
                    f"use https://api.DOMAIN through the ingress {hint}")
            return ApiAddress(scheme, host=host, port=port)
    raise InvalidArgumentError(f"invalid API address '{text}' {hint}")


def config_home(env=None):
    env = os.environ if env is None else env
    xdg = env.get("XDG_CONFIG_HOME", "")
    if xdg.startswith("/"):
        return xdg
    home = env.get("HOME", "")
    if home.startswith("/"):
        return home + "/.config"
    try:
        pw_dir = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        pw_dir = ""
    if pw_dir.startswith("/"):
        return pw_dir + "/.config"
    raise NotFoundError("cannot tell where the home directory is (HOME is not set)")


def token_file(ref, env=None):
    return os.path.join(config_home(env), "sandgate", "tokens", validate_ref(ref))


def _read_small_file(path, max_bytes):
    """A small regular file's text, not through a symlink (these files hold secrets), as the CLI reads it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"{path} does not exist") from None
    except OSError as e:
        raise SandgateError(f"open {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidArgumentError(f"{path} is larger than {max_bytes} bytes")
    return data.decode("utf-8", "replace")


def save_token(ref, token, env=None):
    """Writes the token file as `sandgate create` does; returns its path."""
    validate_token(token)
    home = config_home(env)
    dirs = [home, os.path.join(home, "sandgate"), os.path.join(home, "sandgate", "tokens")]
    for i, d in enumerate(dirs):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        if i > 0:  # config home itself is the user's; only our own directories are forced to 0700
            os.chmod(d, 0o700)
    path = token_file(ref, env)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    return path


def load_token(ref, env=None):
    path = token_file(ref, env)
    try:
        text = _read_small_file(path, MAX_TOKEN_FILE_BYTES)
    except NotFoundError:
        raise NotFoundError(f"no token saved for {ref} at {path}") from None
    token = text.strip()
    if not token:
        raise NotFoundError(f"{path} holds no token")
    if not _TOKEN.fullmatch(token) or len(token) > MAX_TOKEN_CHARS:
        raise InvalidArgumentError(f"{path} does not hold a token (one line, no spaces)")
    return token


def remove_token(ref, env=None):
    try:
        os.unlink(token_file(ref, env))
    except FileNotFoundError:
        pass


def parse_ingress_file(text, path):
    """key=value lines (ingress, cacert, domain), '#' comments; unknown keys skipped, as the CLI reads it."""
    out = {}
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise InvalidArgumentError(f"{path}:{n}: expected key=value")
        key, value = key.strip(), value.strip()
        if key == "ingress":
            parse_host_port(value, "ingress")
        elif key == "cacert" and not value.startswith("/"):
            raise InvalidArgumentError(f"{path}:{n}: cacert must be an absolute path, got '{value}'")
        elif key == "domain" and not value:
            raise InvalidArgumentError(f"{path}:{n}: empty domain")
        if key in ("ingress", "cacert", "domain"):
            out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
    api: ApiAddress
    operator_token: str        # "" = none
    cacert: str                # "" = the system's trust store
    ingress: tuple             # (host, port) to dial for sandgate-proxy
    domain: str

    @property
    def ingress_port(self):
        return self.ingress[1]

    @classmethod
    def resolve(cls, api=None, token=None, cacert=None, ingress=None, domain=None, env=None):
        env = os.environ if env is None else env

        def pick(arg, name):
            return arg if arg else env.get(name, "")

        address = parse_api_address(pick(api, "SANDGATE_API") or DEFAULT_API)
        from_file = {}
        if address.kind == "unix":
            path = os.path.join(os.path.dirname(address.path), INGRESS_FILE_NAME)
            try:
                from_file = parse_ingress_file(_read_small_file(path, MAX_INGRESS_FILE_BYTES), path)
            except NotFoundError:
                pass
        url_domain = ""
        if address.kind == "https" and address.host.startswith("api."):
            url_domain = address.host[len("api."):]
        ingress_text = pick(ingress, "SANDGATE_INGRESS")
        if ingress_text:
            where = parse_host_port(ingress_text, "ingress")
        elif address.kind == "https":
            where = (address.host, address.port)
        else:
            where = parse_host_port(from_file.get("ingress", DEFAULT_INGRESS), "ingress")
        op = pick(token, "SANDGATE_TOKEN").strip()
        if op:
            validate_token(op, "operator token")
        return cls(
            api=address,
            operator_token=op,
            cacert=pick(cacert, "SANDGATE_CACERT") or from_file.get("cacert", ""),
            ingress=where,
            domain=(pick(domain, "SANDGATE_DOMAIN") or url_domain or from_file.get("domain", "")
                    or DEFAULT_DOMAIN).rstrip("."),
        )

    def sandbox_host(self, ref, port=None):
        """<ref>.<domain> (the agent) or <port>-<ref>.<domain>."""
        validate_ref(ref)
        return f"{port}-{ref}.{self.domain}" if port is not None else f"{ref}.{self.domain}"

    def url(self, host):
        port = self.ingress_port
        return f"https://{host}/" if port == 443 else f"https://{host}:{port}/"


def quote_query_path(path):
    """A file path for the agent's ?path= (a literal '+' must be %2B there)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgumentError(f"a sandbox file path must be absolute, got {path!r}")
    return urllib.parse.quote(path, safe="/")
