package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The real node lives in a network namespace of its own, so neither side can reach the other's
// loopback. These bridges, running in the supervisor, connect them without a veth pair or any
// change to the host's network: a socket created while a (locked) thread is inside the node's
// namespace stays there, while the process keeps working in the host namespace.

// inNetns runs fn on a thread switched into the network namespace at nsPath, then switches back.
func inNetns(nsPath string, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	host, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return err
	}
	defer host.Close()
	target, err := os.Open(nsPath)
	if err != nil {
		return err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("setns %s: %w", nsPath, err)
	}
	fnErr := fn()
	if err := unix.Setns(int(host.Fd()), unix.CLONE_NEWNET); err != nil {
		// The thread is unusable now; Go must not hand it to other goroutines. Exiting the
		// locked goroutine without unlocking makes the runtime retire the thread.
		panic(fmt.Sprintf("cannot return to the host network namespace: %v", err))
	}
	return fnErr
}

// listenInNetns opens a TCP listener inside the namespace at nsPath.
func listenInNetns(nsPath, addr string) (net.Listener, error) {
	var l net.Listener
	err := inNetns(nsPath, func() (err error) {
		l, err = net.Listen("tcp", addr)
		return err
	})
	return l, err
}

// dialInNetns connects from inside the namespace at nsPath.
func dialInNetns(ctx context.Context, nsPath, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetns(nsPath, func() (err error) {
		d := net.Dialer{Timeout: 10 * time.Second}
		c, err = d.DialContext(ctx, "tcp", addr)
		return err
	})
	return c, err
}

// bridge owns the listeners of the real node's network bridges and closes them together.
type bridge struct {
	mu        sync.Mutex
	listeners []net.Listener
}

func (b *bridge) add(l net.Listener) {
	b.mu.Lock()
	b.listeners = append(b.listeners, l)
	b.mu.Unlock()
}

func (b *bridge) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, l := range b.listeners {
		_ = l.Close()
	}
	b.listeners = nil
}

// forward accepts on l and connects each client with dial(), copying both ways.
func (b *bridge) forward(name string, l net.Listener, dial func(ctx context.Context) (net.Conn, error)) {
	b.add(l)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return // listener closed
			}
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				up, err := dial(ctx)
				cancel()
				if err != nil {
					log.Printf("%s: %v", name, err)
					_ = c.Close()
					return
				}
				splice(c, up)
			}()
		}
	}()
}

// connectProxy serves HTTP CONNECT on l (a unix socket the kube-apiserver's egress selector
// dials for its "cluster" traffic: kubelet logs/exec/port-forward, node/pod/service proxies).
// Destinations in the node's networks are dialled inside its namespace, all others on the host,
// so webhooks and fake (kwok) nodes on host loopback behave as without a real node.
func (b *bridge) connectProxy(l net.Listener, nsPath string, inNode func(ip net.IP) bool) {
	b.add(l)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go b.serveConnect(c, nsPath, inNode)
		}
	}()
}

func (b *bridge) serveConnect(c net.Conn, nsPath string, inNode func(ip net.IP) bool) {
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil || req.Method != http.MethodConnect {
		_, _ = io.WriteString(c, "HTTP/1.1 405 Method Not Allowed\r\n\r\n")
		_ = c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	addr := req.Host
	host, _, err := net.SplitHostPort(addr)
	ip := net.ParseIP(host)
	if err != nil || ip == nil {
		_, _ = io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n")
		_ = c.Close()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var up net.Conn
	if inNode(ip) {
		up, err = dialInNetns(ctx, nsPath, addr)
	} else {
		up, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	}
	if err != nil {
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
		_ = c.Close()
		return
	}
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		_ = c.Close()
		_ = up.Close()
		return
	}
	// The client speaks first (TLS, HTTP), so nothing is buffered beyond the request.
	if br.Buffered() > 0 {
		pending, _ := br.Peek(br.Buffered())
		if _, err := up.Write(pending); err != nil {
			_ = c.Close()
			_ = up.Close()
			return
		}
	}
	splice(c, up)
}

// splice copies a<->b until either side closes, then closes both.
func splice(a, b net.Conn) {
	var wg sync.WaitGroup
	wg.Add(2)
	cp := func(dst, src net.Conn) {
		defer wg.Done()
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = tc.CloseWrite()
		} else {
			_ = dst.Close()
		}
	}
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
	_ = a.Close()
	_ = b.Close()
}
